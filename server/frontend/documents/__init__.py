"""Texts as people send them: documents of sentences, HTML and XML markup, placeholders.

A text is read into a :class:`.model.Document` (:mod:`.markup` for HTML and XML, :func:`.model.plain_document`
for plain text): verbatim parts (markup, the gaps between sentences) and runs of inline content, where inline
elements and untranslatable spans (placeholders, code, ``translate="no"``) are recorded beside the characters.
:mod:`.segmenter` cuts runs into sentences; each sentence is decoded like any other (:mod:`.translate`), and
:mod:`.transfer` puts the run back together around the translations, moving inline elements and placeholders
through the word alignments.
"""
