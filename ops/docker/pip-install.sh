#!/bin/sh
# `pip install "$@"` for the image build. When it fails because the index's TLS certificate cannot
# be verified (a proxy that inspects TLS), say that in one line rather than pip's
# "no matching distribution".
pip install --no-cache-dir "$@" && exit 0
status=$?
python3 - <<'PY'
import os, ssl, sys, urllib.error, urllib.request
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
try:
    urllib.request.urlopen(f"{index}/pip/", timeout=20, context=context)
except urllib.error.URLError as error:
    if isinstance(error.reason, ssl.SSLCertVerificationError):
        print(f"pip failed because {index} presents a TLS certificate this image does not trust "
              f"({error.reason.verify_message}): a proxy inspecting TLS? Copy its CA certificate (*.crt) "
              "into ops/docker/certs/ and build again.", file=sys.stderr)
except Exception:
    pass
PY
exit $status
