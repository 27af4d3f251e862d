"""Grafana: the dashboard as code, its generated JSON and the provisioning files."""
