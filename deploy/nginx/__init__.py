"""The nginx files of ``docker-compose.yml``'s ``grpc-proxy`` (``translator.conf``, the gRPC balancer, and
``translator-http.conf``, the HTTP/JSON one) and the main ``nginx.conf`` that includes them.

The nginx image's ``/etc/nginx/nginx.conf`` includes ``/etc/nginx/conf.d/*.conf`` inside ``http {}``, and the
compose file mounts these files there. :func:`main_config` is that main file for a directory of your own, so
``tests/test_deploy.py`` runs ``nginx -t`` on the files exactly as shipped. :func:`standalone_config` runs
them on loopback (tests/test_scale.py, benchmarks/proxy.py) with the one substitution a machine without the
compose network needs: each file's ``server translator:PORT`` line becomes one line per replica address (same
parameters), and its ``listen PORT`` becomes a free loopback port.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "translator.conf"  # gRPC, mounted as /etc/nginx/conf.d/default.conf
HTTP_CONFIG = HERE / "translator-http.conf"  # HTTP/JSON, mounted as /etc/nginx/conf.d/http.conf
UPSTREAM_LINE = re.compile(r"^(\s*)server translator:\d+( [^;]*)?;", re.M)
LISTEN_LINE = re.compile(r"^(\s*)listen \d+(?=[ ;])", re.M)
TEMP_PATHS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def main_config(conf_d: Path, workdir: Path) -> str:
    """An ``nginx -c`` file laid out as the nginx image's ``nginx.conf``: ``include conf_d/*.conf`` inside
    ``http {}``, in the foreground, its pid, logs and temporary files in ``workdir``. (The image's other
    lines, ``user nginx``, log formats and MIME types, concern none of the included files.)"""
    temp = "\n".join(f"    {kind}_temp_path {workdir / kind};" for kind in TEMP_PATHS)
    return (f"daemon off;\nworker_processes 1;\npid {workdir / 'nginx.pid'};\nerror_log {workdir / 'error.log'} warn;\n"
            f"events {{ worker_connections 1024; }}\nhttp {{\n    access_log off;\n{temp}\n"
            f"    include {conf_d}/*.conf;\n}}\n")


def on_loopback(path: Path, upstreams: Sequence[str], port: int) -> str:
    """The text of ``path`` with its one ``server translator:PORT`` line replaced by one per address in
    ``upstreams`` and its one ``listen PORT`` by ``listen 127.0.0.1:port``."""
    text = path.read_text(encoding="utf-8")
    if len(UPSTREAM_LINE.findall(text)) != 1 or len(LISTEN_LINE.findall(text)) != 1:
        raise ValueError(f"{path} must have one `server translator:PORT` line and one `listen PORT`")
    text = UPSTREAM_LINE.sub(lambda m: "\n".join(f"{m[1]}server {a}{m[2] or ''};" for a in upstreams), text)
    return LISTEN_LINE.sub(lambda m: f"{m[1]}listen 127.0.0.1:{port}", text)


def standalone_config(upstreams: Sequence[str], port: int, workdir: Path, *,
                      http_upstreams: Sequence[str] = (), http_port: int = 0) -> str:
    """An ``nginx -c`` file (:func:`main_config`) for the replicas' gRPC addresses ``upstreams``, balanced on
    127.0.0.1:``port`` by ``translator.conf``, and, given ``http_upstreams``, their HTTP addresses balanced on
    ``http_port`` by ``translator-http.conf``. Writes the files it includes to ``workdir/conf.d``."""
    conf_d = workdir / "conf.d"
    conf_d.mkdir(parents=True, exist_ok=True)
    (conf_d / CONFIG.name).write_text(on_loopback(CONFIG, upstreams, port), encoding="utf-8")
    http = conf_d / HTTP_CONFIG.name
    if http_upstreams:
        http.write_text(on_loopback(HTTP_CONFIG, http_upstreams, http_port), encoding="utf-8")
    else:
        http.unlink(missing_ok=True)
    return main_config(conf_d, workdir)
