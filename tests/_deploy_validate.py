"""Validate rendered Kubernetes YAML against the bundled schemas; runs in .venv-deploy.

Called by tests/test_deploy.py with the tools venv's interpreter (kubernetes-validate
lives there, not in the main venv). Prints one JSON line per object:
{"file", "kind", "apiVersion", "name", "status": "ok" | "invalid" | "no-schema", "error"}.
Exit status 0 even when objects are invalid: the caller decides what is allowed.
"""

from __future__ import annotations

import json
import sys

import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError, latest_version


def main(paths: list[str]) -> int:
    version = latest_version()
    for path in paths:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        for doc in docs:
            row = {
                "file": path,
                "kind": doc.get("kind"),
                "apiVersion": doc.get("apiVersion"),
                "name": (doc.get("metadata") or {}).get("name"),
                "version": version,
                "status": "ok",
                "error": "",
            }
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except SchemaNotFoundError as exc:
                row.update(status="no-schema", error=str(exc))
            except ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                row.update(status="invalid", error=f"{where}: {exc.message}")
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
