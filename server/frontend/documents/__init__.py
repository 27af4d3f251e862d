"""Texts as people send them: documents of sentences, HTML and XML markup, placeholders.

A text is read into a :class:`~server.frontend.documents.model.Document` (:mod:`server.frontend.documents.markup` for HTML and
XML, :func:`server.frontend.documents.model.plain_document` for plain text): verbatim parts (markup, the gaps between
sentences) and runs of inline content, where inline elements and untranslatable spans (placeholders, code,
``translate="no"``) are recorded beside the characters. :mod:`server.frontend.documents.segmenter` cuts runs into
sentences; each sentence is decoded like any other (:mod:`server.frontend.documents.translate`), and
:mod:`server.frontend.documents.transfer` puts the run back together around the translations, moving inline
elements and placeholders through the word alignments.
"""
