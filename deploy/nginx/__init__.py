"""``translator.conf`` (the nginx gRPC load balancer of ``docker-compose.yml``) as a standalone nginx
configuration for given replicas and port, so tests and benchmarks run the repository's own file with an
unprivileged nginx on loopback."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

CONFIG = Path(__file__).resolve().parent / "translator.conf"
UPSTREAM_LINE = re.compile(r"^(\s*)server translator:50051( [^;]*)?;$", re.M)
LISTEN_LINE = re.compile(r"^(\s*)listen 50051 ", re.M)


def standalone_config(upstreams: Sequence[str], port: int, workdir: Path) -> str:
    """An ``nginx -c`` file: ``translator.conf`` with one ``server`` line per address in ``upstreams``
    (same parameters), listening on 127.0.0.1:``port``, its pid, logs and temporary files in ``workdir``."""
    text = CONFIG.read_text(encoding="utf-8")
    if len(UPSTREAM_LINE.findall(text)) != 1 or len(LISTEN_LINE.findall(text)) != 1:
        raise ValueError(f"{CONFIG} must have one `server translator:50051` line and one `listen 50051`")
    text = UPSTREAM_LINE.sub(lambda m: "\n".join(f"{m[1]}server {a}{m[2] or ''};" for a in upstreams), text)
    text = LISTEN_LINE.sub(lambda m: f"{m[1]}listen 127.0.0.1:{port} ", text)
    temp = "\n".join(f"    {kind}_temp_path {workdir / kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"daemon off;\nworker_processes 1;\npid {workdir / 'nginx.pid'};\nerror_log {workdir / 'error.log'} warn;\n"
            f"events {{ worker_connections 1024; }}\nhttp {{\n    access_log off;\n{temp}\n{text}\n}}\n")
