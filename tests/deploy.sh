#!/usr/bin/env bash
# Checks the Kubernetes manifests in deploy/: renders every Kustomize
# directory (kubectl's built-in kustomize), validates what it renders
# against the Kubernetes schemas (kubernetes-validate from PyPI, pinned,
# in a virtualenv beside the Rust build), and runs `portcullis check` on
# the policies each rendered ConfigMap holds.
#   tests/deploy.sh [path/to/portcullis]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=1.37.0
# The Kubernetes version whose schemas the manifests must fit.
KUBERNETES=1.32.0
target="${CARGO_TARGET_DIR:-/tmp/portcullis-target}"
portcullis="${1:-$target/debug/portcullis}"
command -v kubectl >/dev/null || { echo "tests/deploy.sh: kubectl is missing" >&2; exit 1; }

venv="$target/kubernetes-validate-$VERSION"
tests/venv.sh "$venv" kubernetes-validate "kubernetes-validate==$VERSION"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
checked=0
for kustomization in deploy/*/kustomization.yaml; do
  dir=$(dirname "$kustomization")
  name=$(basename "$dir")
  # A Component (deploy/image) renders only inside the directories using it.
  if grep -q '^kind: Component' "$kustomization"; then
    continue
  fi
  kubectl kustomize "$dir" > "$work/$name.yaml"
  "$venv/bin/kubernetes-validate" --strict -k "$KUBERNETES" "$work/$name.yaml"
  # Every ConfigMap key that is a policy file, written out and checked as
  # the mounted directory it becomes.
  # Each portcullis container's args (a line each, split by 0x1f) are parsed by
  # portcullis itself (`--help` after them: a flag or value it refuses
  # fails).
  "$venv/bin/python" - "$work/$name.yaml" "$work/$name-policies" "$work/$name.args" <<'PY'
import os, sys, yaml
rendered, out, args = sys.argv[1:4]
with open(args, "w") as lines:
    for doc in yaml.safe_load_all(open(rendered)):
        if not doc:
            continue
        if doc.get("kind") == "ConfigMap":
            for key, text in (doc.get("data") or {}).items():
                if key.endswith((".yaml", ".yml")):
                    os.makedirs(out, exist_ok=True)
                    open(os.path.join(out, key), "w").write(text)
        pod = (doc.get("spec") or {}).get("template", {}).get("spec", {})
        # Only portcullis' own containers (a Redis beside it has its own).
        for c in pod.get("containers", []):
            if c.get("args") and c.get("name") == "portcullis":
                lines.write("\x1f".join(c["args"]) + "\n")
PY
  while IFS=$'\x1f' read -r -a args; do
    "$portcullis" "${args[@]}" --help >/dev/null
    echo "deploy/$name: portcullis ${args[0]} takes the container's args"
  done < "$work/$name.args"
  if [ -d "$work/$name-policies" ]; then
    # With the webhook secret set, so the route's plugin is loaded too.
    WEBHOOK_SECRET=check "$portcullis" check --policies "$work/$name-policies"
    echo "deploy/$name: policies pass portcullis check"
  fi
  checked=$((checked + 1))
done
echo "deploy: $checked Kustomize directories rendered and valid against Kubernetes $KUBERNETES"
