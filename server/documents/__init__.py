"""Texts as people send them: documents of sentences, HTML and XML markup, placeholders.

A text is read into a :class:`~server.documents.model.Document` (:mod:`server.documents.markup` for HTML and
XML, :func:`server.documents.model.plain_document` for plain text): verbatim parts (markup, the gaps between
sentences) and runs of inline content, where inline elements and untranslatable spans (placeholders, code,
``translate="no"``) are recorded beside the characters. :mod:`server.documents.segmenter` cuts runs into
sentences; each sentence is decoded like any other (:mod:`server.documents.translate`), and
:mod:`server.documents.transfer` puts the run back together around the translations, moving inline
elements and placeholders through the word alignments.
"""
