"""Locust load tests of the translator (``nmt loadtest``)."""
