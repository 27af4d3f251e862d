"""Deployment files: Prometheus and Grafana configuration for docker-compose.yml."""
