// The alignment explorer: GET /v1/models, POST /v1/translate (proto3 JSON), and two views of each hypothesis's
// alignment: a target x source heatmap of the attention weights, and source/target words linked by the hard
// word alignments. With "Stream", each sentence goes to POST /v1/translate:stream (server-sent events): its
// words appear as the search decides them and its heatmap grows row by row, then the whole result replaces
// them. A document (Input: plain text, HTML or XML) is one text: the translated document is shown as its text
// content with every word linked to its partners across the document (sourceWords, targetWords,
// wordAlignments), the output markup beside it, and each sentence's heatmap on demand. No dependencies, no
// build step.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const CODES = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
  "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
  "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"];
let models = [];

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text) node.textContent = text;
  return node;
}

function svgEl(tag, attrs = {}, text = "") {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text) node.textContent = text;
  return node;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

// A failed call's body is google.rpc.Status in JSON: {code, message, details}.
async function call(method, path, body) {
  const response = await send(method, path, body);
  return response.json();
}

async function send(method, path, body) {
  const response = await fetch(path, {
    method, headers: body ? { "content-type": "application/json" } : {}, body: body ? JSON.stringify(body) : undefined,
  });
  if (!response.ok) {
    let payload = null;
    try { payload = await response.json(); } catch (_) { /* not JSON: reported below */ }
    throw statusError(payload, `${response.status} `, response.statusText, response.headers.get("x-request-id"));
  }
  return response;
}

function statusError(status, prefix, fallback, id) {
  const code = status && Number.isInteger(status.code) ? CODES[status.code] || status.code : "HTTP error";
  const message = status && status.message ? status.message : fallback;
  return new Error(`${prefix}${code}: ${message}` + (id ? `\n(request id ${id})` : ""));
}

// The events of a text/event-stream body: [name, parsed data] for each, as they arrive.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      yield [name, JSON.parse(data)];
    }
  }
}

// One sentence through TranslateStreaming into ``section``: the words so far and their heatmap rows as they
// come; returns the final TranslateResponse.
async function streamOne(text, request, section) {
  const response = await send("POST", "v1/translate:stream", { ...request, texts: [text] });
  const source = text.split(/\s+/);  // the source words: Attention's columns
  const live = el("p", { class: "live", "aria-live": "polite", "aria-label": "translation so far" });
  const view = el("div", { class: "views" });
  section.append(live, view);
  let sofar = "", weights = [], alignments = [], rows = 0;
  for await (const [name, delta] of events(response)) {
    if (name === "error") throw statusError(delta, "", "the stream failed", response.headers.get("x-request-id"));
    sofar += delta.text || "";
    live.textContent = sofar;
    const attention = delta.attention;
    if (attention && attention.targetLength) {
      weights = weights.concat(attention.weights);
      alignments = alignments.concat(attention.wordAlignments || []);
      rows += attention.targetLength;
      const grown = { targetLength: rows, sourceLength: attention.sourceLength, weights, wordAlignments: alignments };
      view.replaceChildren(heatmap(grown, source, sofar.trim().split(/\s+/)));
    }
    if (delta.final) return delta.final;
  }
  throw new Error("the stream ended without its translation");
}

async function loadModels() {
  try {
    models = (await call("GET", "v1/models")).models || [];
  } catch (error) {
    showError(`Could not list the models. ${error.message}`);
    return;
  }
  const select = $("model");
  select.replaceChildren();
  const names = [...new Set(models.map((m) => m.name))];
  for (const name of names) {
    const info = models.find((m) => m.name === name);
    const option = el("option", { value: name }, `${name} (${info.architecture}, ${info.sourceLanguage}→${info.targetLanguage})`);
    if (info.isDefault) option.selected = true;
    select.append(option);
  }
  fillVersions();
}

// Language pairs (GET /v1/languages): "auto → target" for each target, then every pair; the value is "source|target".
async function loadLanguages() {
  let pairs = [];
  try {
    pairs = (await call("GET", "v1/languages")).pairs || [];
  } catch (error) {
    return;  // an older server: the model select alone
  }
  const select = $("pair");
  for (const target of [...new Set(pairs.map((p) => p.targetLanguage))]) {
    select.append(el("option", { value: `auto|${target}` }, `auto → ${target}`));
  }
  for (const p of pairs) {
    select.append(el("option", { value: `${p.sourceLanguage}|${p.targetLanguage}` },
      `${p.sourceLanguage} → ${p.targetLanguage} (${p.model})`));
  }
}

function fillVersions() {
  const select = $("version");
  select.replaceChildren(el("option", { value: "" }, "newest"));
  for (const m of models.filter((m) => m.name === $("model").value)) {
    select.append(el("option", { value: m.version }, m.version + (m.isLatest ? " (newest)" : "")));
  }
  const info = models.find((m) => m.name === $("model").value && m.isLatest);
  if (info && info.maxBeamSize) { $("beam").max = info.maxBeamSize; $("nbest").max = info.maxBeamSize; }
}

// A failed request replaces what is on screen: results left under the error would read as its answer.
function fail(message) {
  $("status").textContent = "";
  $("results").replaceChildren();
  showError(message);
}

async function translate(event) {
  event.preventDefault();
  const format = $("format").value;
  const texts = format ? ($("texts").value.trim() ? [$("texts").value] : [])
    : $("texts").value.split("\n").map((t) => t.trim()).filter((t) => t);
  showError("");
  if (!texts.length) { fail("Type a sentence first."); return; }
  if (format && $("stream").checked) { fail("Stream translates sentences one per line; choose that input."); return; }
  const request = {
    texts, model: $("model").value, modelVersion: $("version").value,
    options: { beamSize: Number($("beam").value) || 0, numHypotheses: Number($("nbest").value) || 0,
      returnAttention: true, returnScores: true },
  };
  if (format) request.textFormat = format;
  Object.assign(request, glossaryFields($("glossary").value, $("glossary-id").value.trim()));
  if ($("pair").value) {  // the server chooses the model of the pair
    const [source, target] = $("pair").value.split("|");
    Object.assign(request, { sourceLanguage: source, targetLanguage: target, model: "", modelVersion: "" });
  }
  $("translate").disabled = true;
  $("status").textContent = "Translating…";
  const started = performance.now();
  try {
    const response = $("stream").checked ? await streamAll(texts, request) : await call("POST", "v1/translate", request);
    const detected = (response.translations || [])[0]?.detectedLanguage;
    $("status").textContent = `${response.model} version ${response.modelVersion}, ` +
      `${Math.round(performance.now() - started)} ms` + (detected ?
        `, detected ${detected} (${Math.round(100 * response.translations[0].detectedConfidence)} %)` : "");
    if (format) renderDocument(response.translations[0], texts[0], format);
    else render(response, texts);
  } catch (error) {
    fail(error.message);
  } finally {
    $("translate").disabled = false;
  }
}

// The glossary box as request fields: "source = target" lines as inline entries, lone terms kept as they are.
function glossaryFields(text, id) {
  const glossary = [], doNotTranslate = [];
  for (const line of text.split("\n").map((l) => l.trim()).filter((l) => l)) {
    const at = line.indexOf("=");
    if (at < 0) doNotTranslate.push(line);
    else glossary.push({ source: line.slice(0, at).trim(), target: line.slice(at + 1).trim() });
  }
  const fields = {};
  if (glossary.length) fields.glossary = glossary;
  if (doNotTranslate.length) fields.doNotTranslate = doNotTranslate;
  if (id) fields.glossaryId = id;
  return fields;
}

// The stored glossaries' ids as suggestions (none where the store is off or the token may not list them).
async function loadGlossaries() {
  try {
    const response = await call("GET", "v1/glossaries");
    $("glossary-ids").replaceChildren(...(response.glossaries || []).map((g) => el("option", { value: g.glossaryId },
      `${g.sourceLanguage} → ${g.targetLanguage}`)));
  } catch (_) { /* no store: the box takes inline terms only */ }
}

// ``text`` as nodes, each occurrence of a term's target in <mark class="term">.
function marked(text, terms) {
  const targets = [...new Set((terms || []).map((t) => t.target).filter((t) => t))].sort((a, b) => b.length - a.length);
  if (!targets.length) return [document.createTextNode(text)];
  const escaped = targets.map((t) => t.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"));
  return text.split(new RegExp(`(${escaped.join("|")})`)).filter((part) => part).map((part) =>
    targets.includes(part) ? el("mark", { class: "term", title: "glossary term" }, part) : document.createTextNode(part));
}

// Every sentence streamed at once, each in a section of its own; the responses joined as one.
async function streamAll(texts, request) {
  const results = $("results");
  results.replaceChildren();
  const sections = texts.map((text) => {
    const section = el("section", { class: "translation streaming" });
    section.append(el("h2", {}, text));
    results.append(section);
    return section;
  });
  const finals = await Promise.all(texts.map((text, i) => streamOne(text, request, sections[i])));
  return { ...finals[0], translations: finals.flatMap((f) => f.translations) };
}

function render(response, texts) {
  const results = $("results");
  results.replaceChildren();
  response.translations.forEach((translation, i) => {
    const section = el("section", { class: "translation" });
    section.append(el("h2", {}, texts[i] || ""));
    section.append(el("div", { class: "source" }, `source words: ${translation.sourceTokens.join(" · ")}`));
    if ((translation.terms || []).length) {
      section.append(el("div", { class: "source" }, "glossary terms: " +
        translation.terms.map((t) => `${t.source} → ${t.target}`).join(" · ")));
    }
    translation.hypotheses.forEach((hypothesis, rank) => {
      section.append(renderHypothesis(hypothesis, rank, translation.sourceTokens, translation.terms));
    });
    results.append(section);
  });
}

// The text content of a document as the server counts it (markup left out, references decoded): a fragment
// parsed in a <template>, as the server's parser reads a fragment, or XML inside a root.
function textContent(markup, format) {
  if (format === "TEXT_FORMAT_PLAIN") return markup;
  if (format === "TEXT_FORMAT_XML") {
    const parsed = new DOMParser().parseFromString(`<r>${markup.replace(/^\s*<\?xml[^>]*\?>/, "")}</r>`, "application/xml");
    return parsed.documentElement.textContent;
  }
  const template = document.createElement("template");
  template.innerHTML = markup;
  return template.content.textContent;
}

// Words of ``text`` (spans in code points) as focusable spans, the text between them as it is.
function wordSpans(text, words, side) {
  const chars = [...text];
  const box = el("div", { class: `document ${side}`, "aria-label": side === "src" ? "source document" : "translated document" });
  let at = 0;
  words.forEach((word, i) => {
    const start = word.start || 0, end = word.end || 0;
    if (start > at) box.append(document.createTextNode(chars.slice(at, start).join("")));
    box.append(el("span", { class: `word ${side}`, tabindex: "0", "data-index": i, "data-segment": word.segment || 0 },
      chars.slice(start, end).join("")));
    at = Math.max(at, end);
  });
  if (at < chars.length) box.append(document.createTextNode(chars.slice(at).join("")));
  return box;
}

function renderDocument(translation, source, format) {
  const results = $("results");
  results.replaceChildren();
  const section = el("section", { class: "translation document-view" });
  const best = translation.hypotheses[0] || { text: "" };
  const pairs = translation.wordAlignments || [];
  const src = wordSpans(textContent(source, format), translation.sourceWords || [], "src");
  const tgt = wordSpans(textContent(best.text, format), translation.targetWords || [], "tgt");
  const partners = (side, index) => pairs.filter((a) => ((side === "src" ? a.sourceIndex : a.targetIndex) || 0) === index)
    .map((a) => (side === "src" ? a.targetIndex : a.sourceIndex) || 0);
  for (const [box, other, side] of [[src, tgt, "src"], [tgt, src, "tgt"]]) {
    box.querySelectorAll("span.word").forEach((node) => {
      const index = Number(node.dataset.index);
      const on = (flag) => {
        node.classList.toggle("on", flag);
        for (const j of partners(side, index)) {
          const partner = other.querySelector(`span.word[data-index="${j}"]`);
          if (partner) partner.classList.toggle("on", flag);
        }
      };
      for (const [type, flag] of [["mouseenter", true], ["mouseleave", false], ["focus", true], ["blur", false]]) {
        node.addEventListener(type, () => on(flag));
      }
    });
  }
  section.append(el("h2", {}, `${(translation.segments || []).length} sentences`), src, tgt);
  if (format !== "TEXT_FORMAT_PLAIN") {
    section.append(el("h3", {}, "Translated markup"), el("pre", { class: "markup" }, best.text));
  }
  (translation.segments || []).forEach((segment, k) => {
    const own = segment.hypotheses && segment.hypotheses.length ? segment : translation;
    const details = el("details", { class: "segment" });
    const sourceText = [...textContent(source, format)].slice(segment.sourceStart || 0, segment.sourceEnd || 0).join("");
    details.append(el("summary", {}, `Sentence ${k + 1}: ${sourceText}`));
    details.addEventListener("toggle", () => {
      if (details.open && details.children.length === 1) {
        own.hypotheses.forEach((h, rank) => details.append(renderHypothesis(h, rank, own.sourceTokens)));
      }
    }, { once: false });
    section.append(details);
  });
  results.append(section);
}

function renderHypothesis(hypothesis, rank, source, terms) {
  const box = el("article", { class: "hypothesis", "aria-label": `hypothesis ${rank + 1}` });
  const title = el("h3", {});
  title.append(el("span", { class: "hyp-text" }));
  title.lastChild.append(...marked(hypothesis.text, terms));
  title.append(el("span", { class: "score" }, `#${rank + 1} · score ${Number(hypothesis.score).toFixed(4)}`));
  if (hypothesis.termsMissed) {
    title.append(el("span", { class: "missed" }, "the glossary's terms did not fit the length limit"));
  }
  box.append(title);
  const attention = hypothesis.attention;
  if (!attention || !attention.targetLength) {
    box.append(el("p", { class: "hint" }, "No attention returned."));
    return box;
  }
  const target = hypothesis.tokens;
  const views = el("div", { class: "views" });
  views.append(heatmap(attention, source, target), links(attention, source, target));
  box.append(views);
  return box;
}

// The target x source weights, row-major; a cell's shade is its weight (hover or focus shows the value).
function heatmap(attention, source, target) {
  const wrap = el("div", { class: "scroll" });
  const readout = el("div", { class: "weight", "aria-live": "polite" }, "hover a cell, or Tab here and use the arrow keys");
  let at = 0;  // the cell the arrow keys move from
  const table = el("table", { class: "heatmap", "aria-label": "attention weights, target rows by source columns" });
  const head = el("tr");
  head.append(el("th", { scope: "col" }, "target \\ source"));
  for (let s = 0; s < attention.sourceLength; s++) head.append(el("th", { scope: "col" }, source[s] ?? "</s>"));
  table.appendChild(el("thead")).append(head);
  const body = table.appendChild(el("tbody"));
  for (let t = 0; t < attention.targetLength; t++) {
    const row = body.appendChild(el("tr"));
    row.append(el("th", { scope: "row" }, target[t] ?? "</s>"));
    for (let s = 0; s < attention.sourceLength; s++) {
      const weight = attention.weights[t * attention.sourceLength + s] || 0;
      const label = `${target[t] ?? "</s>"} ← ${source[s] ?? "</s>"}: ${weight.toFixed(3)}`;
      const cell = el("td", { class: "cell", title: label, tabindex: "-1", "data-weight": weight.toFixed(4) });
      const light = Math.round(97 - 62 * Math.sqrt(weight));
      cell.style.background = `hsl(212, 80%, ${light}%)`;
      const show = () => { readout.textContent = label; };
      cell.addEventListener("mouseenter", show);
      cell.addEventListener("focus", () => { at = t * attention.sourceLength + s; show(); });
      row.append(cell);
    }
  }
  // keyboard: Tab reaches the table, the arrow keys move between cells (each shows its weight)
  const cells = [...body.querySelectorAll("td.cell")];
  table.tabIndex = 0;
  table.addEventListener("focus", (event) => { if (event.target === table && cells.length) cells[at].focus(); });
  table.addEventListener("keydown", (event) => {
    const step = { ArrowLeft: -1, ArrowRight: 1, ArrowUp: -attention.sourceLength, ArrowDown: attention.sourceLength }[event.key];
    if (step === undefined) return;
    event.preventDefault();
    const next = at + step;
    if (next >= 0 && next < cells.length && (Math.abs(step) > 1 || Math.floor(next / attention.sourceLength) === Math.floor(at / attention.sourceLength))) at = next;
    cells[at].focus();
  });
  wrap.append(table, readout);
  return wrap;
}

let measure = null;
function textWidth(text) {
  measure = measure || document.createElement("canvas").getContext("2d");
  measure.font = "13px system-ui, sans-serif";
  return measure.measureText(text).width;
}

// Source words on top, target words below, a line per hard word alignment; hovering or focusing a word
// highlights its partners and their lines.
function links(attention, source, target) {
  const gap = 14, top = 18, bottom = 92;
  const place = (words) => {
    let x = 4;
    return words.map((word) => { const w = textWidth(word); const at = { x, w, mid: x + w / 2 }; x += w + gap; return at; });
  };
  const sx = place(source), tx = place(target);
  const width = Math.max(...[...sx, ...tx].map((p) => p.x + p.w), 100) + 8;
  const svg = svgEl("svg", { class: "links", width, height: bottom + 10, role: "group",
    "aria-label": "word alignments: source words above, target words below" });
  const pairs = (attention.wordAlignments || []).filter((a) => (a.sourceIndex ?? 0) < source.length &&
    (a.targetIndex ?? 0) < target.length);
  const lines = pairs.map((a) => {
    const s = a.sourceIndex ?? 0, t = a.targetIndex ?? 0;
    const line = svgEl("line", { x1: sx[s].mid, y1: top + 6, x2: tx[t].mid, y2: bottom - 16, "data-source": s, "data-target": t });
    svg.append(line);
    return line;
  });
  const words = [];
  const word = (text, at, y, side, index) => {
    const node = svgEl("text", { x: at.x, y, tabindex: "0", class: `word ${side}`, "data-index": index }, text);
    const partners = pairs.filter((a) => (side === "src" ? (a.sourceIndex ?? 0) : (a.targetIndex ?? 0)) === index)
      .map((a) => (side === "src" ? `t${a.targetIndex ?? 0}` : `s${a.sourceIndex ?? 0}`));
    node.append(svgEl("title", {}, `${text} ↔ ${partners.length ? partners.map((p) => (p[0] === "s" ? source : target)[+p.slice(1)]).join(", ") : "no partner"}`));
    const on = (flag) => {
      node.classList.toggle("on", flag);
      lines.forEach((line) => { if (+line.dataset[side === "src" ? "source" : "target"] === index) line.classList.toggle("on", flag); });
      words.forEach((w) => { if (partners.includes(w.key)) w.node.classList.toggle("on", flag); });
    };
    for (const [type, flag] of [["mouseenter", true], ["mouseleave", false], ["focus", true], ["blur", false]]) {
      node.addEventListener(type, () => on(flag));
    }
    words.push({ key: `${side === "src" ? "s" : "t"}${index}`, node });
    svg.append(node);
  };
  source.forEach((text, i) => word(text, sx[i], top, "src", i));
  target.forEach((text, i) => word(text, tx[i], bottom, "tgt", i));
  const wrap = el("div", { class: "scroll" });
  wrap.append(svg);
  return wrap;
}

$("request").addEventListener("submit", translate);
$("model").addEventListener("change", fillVersions);
$("texts").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("request").requestSubmit();
});
loadModels();
loadLanguages();
loadGlossaries();
