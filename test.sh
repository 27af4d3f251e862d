#!/usr/bin/env bash
# The test command (README, and CI through .ci/run): the Debian tools some tests run for real, where this shell can
# install them, then the project with its test extras, then pytest. Arguments go to pytest (e.g. -k split, -n 0).
set -euo pipefail
cd "$(dirname "$0")"

# tool -> Debian package, and the tests that run the tool
declare -A PACKAGE=([promtool]=prometheus [docker-compose]=docker-compose [chromium]=chromium
                    [chromedriver]=chromium-driver [nginx]=nginx-light [node]=nodejs [npm]=npm
                    [protoc]=protobuf-compiler [redis-server]=redis-server)
declare -A USERS=([promtool]="tests/test_prometheus.py" [docker-compose]="tests/test_deploy.py"
                  [chromium]="tests/test_explorer.py" [chromedriver]="tests/test_explorer.py"
                  [nginx]="tests/test_deploy.py, tests/test_scale.py" [node]="tests/test_proto_contract.py"
                  [npm]="tests/test_proto_contract.py" [protoc]="tests/test_proto_contract.py"
                  [redis-server]="tests/test_cache.py")
have() { command -v "$1" >/dev/null 2>&1 || { [ "$1" = nginx ] && [ -x /usr/sbin/nginx ]; }; }
missing=()
for tool in "${!PACKAGE[@]}"; do have "$tool" || missing+=("${PACKAGE[$tool]}"); done
[ -f /usr/include/google/protobuf/any.proto ] || missing+=(libprotobuf-dev)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1; }
        # all at once; where one conflicts (Debian's npm beside a Node.js that brings its own), one by one
        apt-get update -qq >/dev/null 2>&1 || true
        install "${missing[@]}" || for package in "${missing[@]}"; do
            install "$package" || echo "test.sh: could not install $package"
        done
    fi
    for tool in "${!PACKAGE[@]}"; do
        have "$tool" || echo "test.sh: $tool not found (Debian ${PACKAGE[$tool]}): ${USERS[$tool]} will skip"
    done
fi

pip install -q -e ".[train,bench,dev]"
# a worker per core (up to 4), a test file's tests in one worker (its module fixtures, e.g. servers, start once);
# the session's models are built once between the workers (tests/conftest.py: built_once). -n 0: one process.
exec python -m pytest -q --durations=15 --numprocesses auto --maxprocesses 4 --dist loadfile "$@"
