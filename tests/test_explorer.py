"""The alignment explorer in a real browser: headless Chromium (Debian ``chromium`` + ``chromium-driver``,
driven by Selenium) loads the page from a live server and translates a date with a really trained model.

The session trains the ``dates-transformer-small`` preset once (about 15 s on one core) and exports it;
the tiny Bahdanau model of the shared fixtures is served beside it, so the page is driven with both
architectures. The screenshot lands in the test's temporary directory and in ``test-artifacts/`` (git-ignored).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.config import ServerConfig
from tests.harness import ServerHarness
from tests.test_server import SlowEngine, default_loader, wrapping_loader

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian chromium and chromium-driver "
                                "(.ci/run installs them)")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
DATES_MODEL = "dates-transformer"


@pytest.fixture(scope="session")
def dates_repository(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path],
                     dates_models: dict[str, Path]) -> Path:
    """A repository with the session's small dates Transformer and the tiny Bahdanau."""
    repository = tmp_path_factory.mktemp("explorer") / "models"
    shutil.copytree(dates_models["transformer"], repository / DATES_MODEL / "1")
    shutil.copytree(tiny_models["bahdanau"], repository / "tiny-bahdanau" / "1")
    return repository


@pytest.fixture(scope="module")
def server(dates_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHarness]:
    glossaries = tmp_path_factory.mktemp("glossaries")
    (glossaries / "weekdays.en.de.tsv").write_text("Tuesday\tMittwoch\n", encoding="utf-8")
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="127.0.0.1:0",
                          model_repository=str(dates_repository), default_model=DATES_MODEL, provider="cpu",
                          intra_op_threads=1, glossary_dir=str(glossaries)).validate()
    h = ServerHarness(config, default_loader())
    yield h
    h.close()


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1280,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def run_translation(browser: webdriver.Chrome, text: str, *, model: str, beam: int, hypotheses: int) -> None:
    """Fill the form as a user does and wait for the results."""
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#model option[value='{model}']"))
    browser.find_element(By.CSS_SELECTOR, f"#model option[value='{model}']").click()
    texts = browser.find_element(By.ID, "texts")
    texts.clear()
    texts.send_keys(text)
    for field, value in (("beam", beam), ("nbest", hypotheses)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))
    browser.execute_script("document.getElementById('results').replaceChildren()")
    browser.find_element(By.ID, "translate").click()
    wait.until(expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "#results .hypothesis")))


HINT = "hover a cell, or Tab here and use the arrow keys"

# Per heatmap box: its scroll geometry, the readout's, and the rectangles of the readout's text (one per line
# fragment) against the box's visible area, all in CSS pixels.
FIGURE_GEOMETRY = """
return [...document.querySelectorAll('#results table.heatmap')].map((table) => {
  const box = table.parentElement, readout = box.querySelector('.weight');
  const visible = box.getBoundingClientRect();
  const range = document.createRange();
  range.selectNodeContents(readout);
  return {
    text: readout.textContent,
    box: [box.scrollWidth, box.clientWidth],
    readout: [readout.scrollWidth, readout.clientWidth, readout.scrollHeight, readout.clientHeight],
    area: [visible.left + box.clientLeft, visible.left + box.clientLeft + box.clientWidth,
           visible.top, visible.bottom],
    lines: [...range.getClientRects()].map((r) => [r.left, r.right, r.top, r.bottom]),
  };
});
"""


def assert_heatmaps_fit(browser: webdriver.Chrome) -> list[dict]:
    """No heatmap box scrolls sideways, and every readout's text lies whole inside its box's visible area."""
    figures = browser.execute_script(FIGURE_GEOMETRY)
    assert figures
    for figure in figures:
        assert figure["box"][0] <= figure["box"][1], figure
        width, client_width, height, client_height = figure["readout"]
        assert width <= client_width and height <= client_height, figure
        left, right, top, bottom = figure["area"]
        assert figure["lines"], figure
        for line in figure["lines"]:
            assert left - 0.5 <= line[0] and line[1] <= right + 0.5, figure
            assert top - 0.5 <= line[2] and line[3] <= bottom + 0.5, figure
    return figures


def test_explorer_translates_a_date_and_shows_its_alignment(server: ServerHarness, browser: webdriver.Chrome,
                                                            tmp_path: Path) -> None:
    browser.get(f"http://127.0.0.1:{server.server.http_port}/")
    run_translation(browser, "Tuesday, April 25, 2045", model=DATES_MODEL, beam=4, hypotheses=2)

    hypotheses = browser.find_elements(By.CSS_SELECTOR, "#results .hypothesis")
    assert len(hypotheses) == 2
    best = hypotheses[0]
    assert best.find_element(By.CSS_SELECTOR, ".hyp-text").text == "Dienstag, 25. April 2045"
    assert "score -" in best.find_element(By.CSS_SELECTOR, ".score").text
    # the heatmap: one row per target word, one cell per source word
    rows = best.find_elements(By.CSS_SELECTOR, "table.heatmap tbody tr")
    columns = best.find_elements(By.CSS_SELECTOR, "table.heatmap thead th")[1:]
    assert [c.text for c in columns] == ["Tuesday,", "April", "25,", "2045"]
    assert [r.find_element(By.TAG_NAME, "th").text for r in rows] == ["Dienstag,", "25.", "April", "2045"]
    cells = best.find_elements(By.CSS_SELECTOR, "table.heatmap td.cell")
    assert len(cells) == len(rows) * len(columns) == 16
    row_sums = [sum(float(c.get_attribute("data-weight")) for c in r.find_elements(By.CSS_SELECTOR, "td.cell"))
                for r in rows]
    assert row_sums == pytest.approx([1.0] * 4, abs=2e-3)
    # hovering a cell shows its weight
    webdriver.ActionChains(browser).move_to_element(cells[0]).perform()
    assert best.find_element(By.CSS_SELECTOR, ".weight").text.startswith("Dienstag, ← Tuesday,: 0.")
    # keyboard: Tab to the table, the arrow keys walk the cells
    browser.execute_script("arguments[0].focus()", best.find_element(By.CSS_SELECTOR, "table.heatmap"))
    browser.switch_to.active_element.send_keys(Keys.ARROW_DOWN, Keys.ARROW_RIGHT)
    assert best.find_element(By.CSS_SELECTOR, ".weight").text.startswith("25. ← April: 0.")
    # the links: a line per word alignment; day and month swap places
    lines = best.find_elements(By.CSS_SELECTOR, "svg.links line")
    pairs = {(int(line.get_attribute("data-source")), int(line.get_attribute("data-target"))) for line in lines}
    assert {(1, 2), (2, 1)} <= pairs and len(lines) >= 4
    # focusing a word (keyboard) highlights it, its partner and their line
    april = best.find_elements(By.CSS_SELECTOR, "svg.links text.word.src")[1]
    browser.execute_script("arguments[0].focus()", april)
    assert best.find_elements(By.CSS_SELECTOR, "svg.links line.on")
    assert "April" in [w.text for w in best.find_elements(By.CSS_SELECTOR, "svg.links text.tgt.on")]
    webdriver.ActionChains(browser).move_to_element(cells[6]).perform()  # hover "25." <- "25,"
    assert not browser.find_element(By.ID, "error").is_displayed()

    shot = tmp_path / "explorer.png"
    assert browser.save_screenshot(str(shot))
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "explorer.png")
    assert shot.stat().st_size > 10_000


def test_explorer_glossary_box_constrains_every_hypothesis_and_marks_the_terms(
        server: ServerHarness, browser: webdriver.Chrome) -> None:
    """A stored glossary (offered by its id) and a do-not-translate line: both hypotheses hold "Mittwoch" for
    "Tuesday" and keep "April", each marked."""
    browser.get(f"http://127.0.0.1:{server.server.http_port}/")
    wait = WebDriverWait(browser, 30)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#glossary-ids option[value='weekdays']"))
    browser.find_element(By.CSS_SELECTOR, "details.glossary-box summary").click()
    browser.find_element(By.ID, "glossary").send_keys("April")
    browser.find_element(By.ID, "glossary-id").send_keys("weekdays")
    run_translation(browser, "Tuesday, April 25, 2045", model=DATES_MODEL, beam=4, hypotheses=2)
    hypotheses = browser.find_elements(By.CSS_SELECTOR, "#results .hypothesis")
    assert len(hypotheses) == 2
    for hypothesis in hypotheses:
        text = hypothesis.find_element(By.CSS_SELECTOR, ".hyp-text").text
        marks = [m.text for m in hypothesis.find_elements(By.CSS_SELECTOR, ".hyp-text mark.term")]
        assert "Mittwoch" in text and "April" in text, text
        assert sorted(set(marks)) == ["April", "Mittwoch"], (text, marks)
    terms = browser.find_element(By.CSS_SELECTOR, "#results .translation .source:nth-of-type(2)").text
    assert "Tuesday → Mittwoch" in terms and "April → April" in terms
    assert not browser.find_element(By.ID, "error").is_displayed()
    # an unknown stored glossary is the server's NOT_FOUND, shown as the error
    browser.find_element(By.ID, "glossary-id").send_keys("-gone")
    browser.find_element(By.ID, "translate").click()
    wait.until(lambda d: d.find_element(By.ID, "error").is_displayed())
    assert "NOT_FOUND" in browser.find_element(By.ID, "error").text


def test_explorer_with_bahdanau_errors_and_a_narrow_screen(server: ServerHarness, browser: webdriver.Chrome,
                                                           tmp_path: Path) -> None:
    browser.set_window_size(375, 800)
    browser.get(f"http://127.0.0.1:{server.server.http_port}/")
    run_translation(browser, "one two three", model="tiny-bahdanau", beam=2, hypotheses=1)
    hypothesis = browser.find_element(By.CSS_SELECTOR, "#results .hypothesis")
    assert hypothesis.find_elements(By.CSS_SELECTOR, "table.heatmap td.cell")
    assert hypothesis.find_elements(By.CSS_SELECTOR, "svg.links line")
    # readable at 375 px: the page does not scroll sideways (wide figures scroll inside their own box)
    assert browser.execute_script("return document.documentElement.scrollWidth") <= 375
    assert [figure["text"] for figure in assert_heatmaps_fit(browser)] == [HINT]
    browser.save_screenshot(str(tmp_path / "explorer-375.png"))
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "explorer-375.png", ARTIFACTS / "explorer-375.png")

    # an error from the service is shown as such
    beam = browser.find_element(By.ID, "beam")
    beam.clear()
    beam.send_keys("50")
    browser.execute_script("document.getElementById('beam').removeAttribute('max')")
    browser.find_element(By.ID, "translate").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "error").is_displayed())
    message = browser.find_element(By.ID, "error").text
    assert message.startswith("400 INVALID_ARGUMENT: ") and "beam_size" in message
    assert browser.find_element(By.ID, "error").get_attribute("role") == "alert"


@pytest.mark.parametrize("width", [1400, 375])
def test_explorer_hint_fits_and_an_error_clears_the_results(server: ServerHarness, browser: webdriver.Chrome,
                                                           tmp_path: Path, width: int) -> None:
    browser.set_window_size(width, 900)
    browser.get(f"http://127.0.0.1:{server.server.http_port}/")
    assert browser.execute_script("return window.innerWidth") <= width
    run_translation(browser, "Tuesday, April 25, 2045", model=DATES_MODEL, beam=4, hypotheses=2)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#results .hypothesis")) == 2

    # under each heatmap the hint is shown whole: wrapped inside the box, which does not scroll sideways
    assert [figure["text"] for figure in assert_heatmaps_fit(browser)] == [HINT, HINT]
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    browser.execute_script("document.querySelector('#results .views').scrollIntoView({block: 'center'})")
    shot = tmp_path / f"explorer-hint-{width}.png"
    assert browser.save_screenshot(str(shot))
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / shot.name)
    # the keyboard still walks the cells, and a cell's weight fits as the hint does
    best = browser.find_element(By.CSS_SELECTOR, "#results .hypothesis")
    browser.execute_script("arguments[0].focus()", best.find_element(By.CSS_SELECTOR, "table.heatmap"))
    browser.switch_to.active_element.send_keys(Keys.ARROW_DOWN, Keys.ARROW_RIGHT)
    assert best.find_element(By.CSS_SELECTOR, ".weight").text.startswith("25. ← April: 0.")
    assert assert_heatmaps_fit(browser)[0]["text"].startswith("25. ← April: 0.")

    # a text over the server's limit (20000 characters): the service refuses it, and the page shows the error
    # alone, without the previous request's results under it
    browser.execute_script("document.getElementById('texts').value = 'x'.repeat(20001)")
    browser.find_element(By.ID, "translate").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "error").is_displayed())
    message = browser.find_element(By.ID, "error").text
    assert message.startswith("400 INVALID_ARGUMENT: texts[0] has 20001 characters"), message
    results = browser.find_elements(By.CSS_SELECTOR, "#results .hypothesis, #results table, #results svg")
    assert not [node for node in results if node.is_displayed()]
    assert browser.find_element(By.ID, "status").text == ""
    shot = tmp_path / f"explorer-error-{width}.png"
    assert browser.save_screenshot(str(shot))
    shutil.copy(shot, ARTIFACTS / shot.name)

    # the next good request clears the error and shows its results
    run_translation(browser, "Monday, May 1, 2000", model=DATES_MODEL, beam=2, hypotheses=1)
    assert not browser.find_element(By.ID, "error").is_displayed()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#results .hypothesis")) == 1


# Every change of the streaming section, as the page saw it: the words so far and the heatmap's rows.
RECORD_STREAM = """
window.snapshots = [];
new MutationObserver(() => {
  const live = document.querySelector('#results .live');
  const rows = document.querySelectorAll('#results table.heatmap tbody tr').length;
  if (live) window.snapshots.push([live.textContent, rows]);
}).observe(document.getElementById('results'), {childList: true, subtree: true, characterData: true});
"""


def test_explorer_streams_words_and_grows_the_heatmap(dates_repository: Path, browser: webdriver.Chrome,
                                                       tmp_path: Path) -> None:
    """With Stream on, words appear as the search decides them and the heatmap grows a row per word (decoding
    slowed to 40 ms a step, so the page can be watched between steps); the whole result then replaces them,
    equal to the one a plain translation shows."""
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="127.0.0.1:0",
                          model_repository=str(dates_repository), default_model=DATES_MODEL, provider="cpu",
                          intra_op_threads=1).validate()
    h = ServerHarness(config, wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.04)))
    try:
        browser.get(f"http://127.0.0.1:{h.server.http_port}/")
        browser.find_element(By.ID, "stream").click()
        browser.execute_script(RECORD_STREAM)
        run_translation(browser, "Tuesday, April 25, 2045", model=DATES_MODEL, beam=1, hypotheses=1)
        best = browser.find_element(By.CSS_SELECTOR, "#results .hypothesis")
        assert best.find_element(By.CSS_SELECTOR, ".hyp-text").text == "Dienstag, 25. April 2045"
        assert len(best.find_elements(By.CSS_SELECTOR, "table.heatmap tbody tr")) == 4
        seen = [(text, rows) for text, rows in browser.execute_script("return window.snapshots") if text]
        texts = list(dict.fromkeys(text for text, _ in seen))
        assert texts[-1] == "Dienstag, 25. April 2045" and len(texts) >= 3  # word by word, not all at once
        for before, after in zip(texts, texts[1:], strict=False):
            assert after.startswith(before)  # words are only ever added
        grown = [rows for _, rows in seen]
        assert grown == sorted(grown) and len(set(grown)) >= 3 and max(grown) < 4  # the heatmap grew row by row
        assert not browser.find_element(By.ID, "error").is_displayed()
        browser.save_screenshot(str(tmp_path / "explorer-stream.png"))
    finally:
        h.close()


def translate_document(browser: webdriver.Chrome, text: str, text_format: str) -> None:
    """Choose a document input, type ``text`` and wait for the translated document."""
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#model option[value='{DATES_MODEL}']"))
    browser.find_element(By.CSS_SELECTOR, f"#model option[value='{DATES_MODEL}']").click()
    browser.find_element(By.CSS_SELECTOR, f"#format option[value='{text_format}']").click()
    browser.execute_script("document.getElementById('texts').value = arguments[0];"
                           "document.getElementById('results').replaceChildren()", text)
    browser.find_element(By.ID, "translate").click()
    wait.until(expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "#results .document.tgt")))


def test_explorer_translates_a_paragraph_and_an_html_snippet(server: ServerHarness, browser: webdriver.Chrome,
                                                            tmp_path: Path) -> None:
    """A paragraph in: the translated document out, with its line break; hovering a word of the second sentence
    lights its partner there; a sentence's heatmap opens on demand. An HTML snippet: the markup kept."""
    browser.get(f"http://127.0.0.1:{server.server.http_port}/")
    translate_document(browser, "Tuesday, April 25, 2045.\nMonday, May 1, 2046.", "TEXT_FORMAT_PLAIN")
    target = browser.find_element(By.CSS_SELECTOR, "#results .document.tgt")
    first, second = target.text.split("\n")
    assert first.startswith("Dienstag, 25. April") and second.startswith("Montag")
    source_words = browser.find_elements(By.CSS_SELECTOR, "#results .document.src span.word")
    assert [w.text for w in source_words] == ["Tuesday,", "April", "25,", "2045.", "Monday,", "May", "1,", "2046."]
    montag = next(w for w in target.find_elements(By.CSS_SELECTOR, "span.word") if w.text.startswith("Montag"))
    webdriver.ActionChains(browser).move_to_element(montag).perform()  # a target word has one partner
    lit = browser.find_elements(By.CSS_SELECTOR, "#results .document.src span.word.on")
    assert len(lit) == 1 and lit[0].text in ["Monday,", "May", "1,", "2046."]  # in the second sentence
    segments = browser.find_elements(By.CSS_SELECTOR, "#results details.segment")
    assert len(segments) == 2
    segments[1].find_element(By.TAG_NAME, "summary").click()  # the page renders it on the toggle event, a task later
    best = WebDriverWait(browser, 10).until(lambda d: segments[1].find_elements(By.CSS_SELECTOR, ".hypothesis"))[0]
    rows = best.find_elements(By.CSS_SELECTOR, "table.heatmap tbody tr")
    assert [r.find_element(By.TAG_NAME, "th").text for r in rows] == second.split()
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(tmp_path / "explorer-paragraph.png"))
    shutil.copy(tmp_path / "explorer-paragraph.png", ARTIFACTS / "explorer-paragraph.png")

    translate_document(browser, "<p><i>Tuesday</i>, April <b>25</b>, 2045</p>", "TEXT_FORMAT_HTML")
    markup = browser.find_element(By.CSS_SELECTOR, "#results pre.markup").text
    assert markup.startswith("<p><i>Dienstag</i>, ") and markup.count("<b>") == 1 and markup.endswith("</p>")
    assert browser.find_element(By.CSS_SELECTOR, "#results .document.tgt").text == "Dienstag, 25. April 2045"
    assert not browser.find_element(By.ID, "error").is_displayed()


def test_explorer_offers_the_pairs_and_auto(server: ServerHarness, browser: webdriver.Chrome) -> None:
    """The languages select lists auto and every served pair; with auto the server picks the pair's model and the
    status line names the language it detected."""
    browser.get(f"http://127.0.0.1:{server.server.http_port}/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#pair option[value='auto|de']"))
    labels = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#pair option")]
    assert labels[:2] == ["the model's", "auto → de"] and f"en → de ({DATES_MODEL})" in labels
    browser.find_element(By.CSS_SELECTOR, "#pair option[value='auto|de']").click()
    run_translation(browser, "Tuesday, April 25, 2045", model="tiny-bahdanau", beam=2, hypotheses=1)
    status = browser.find_element(By.ID, "status").text
    assert status.startswith(f"{DATES_MODEL} version 1") and "detected en" in status  # the pair's, not the select's
    assert browser.find_element(By.CSS_SELECTOR, "#results .hyp-text").text == "Dienstag, 25. April 2045"
