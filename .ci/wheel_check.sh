#!/usr/bin/env bash
# The zoo as a user installs it: the sdist and the wheel built from this checkout, the wheel (core only)
# installed in a fresh virtual environment, and the README's commands and snippets run from an empty
# folder outside the checkout with an empty HOME. Then the [text] extra added for an HTGN config.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
python -m build --sdist --wheel --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 || { tail -20 "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/*.whl)
echo "wheel-check: built $(basename "$wheel") and $(basename "$work"/dist/*.tar.gz)"
# Nothing generic at the top level of the wheel: only the project's four packages (and its metadata).
tops=$(python -c "import sys, zipfile; print(' '.join(sorted({n.split('/')[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()})))" "$wheel")
echo "wheel-check: top-level names: $tops"
for name in $tops; do
  case "$name" in agf_jax|htgn_jax|samovar_jax|zoo_core|linear_attention_zoo-*.dist-info) ;;
    *) echo "wheel-check: the wheel installs a top-level '$name'"; exit 1 ;; esac
done
python3 -m venv "$work/venv"
pip_quiet() { "$work/venv/bin/python" -m pip install -q "$@" > "$work/pip.log" 2>&1 || { tail -20 "$work/pip.log"; exit 1; }; }
pip_quiet --upgrade pip
pip_quiet "$wheel"
echo "wheel-check: core install $(du -sm "$work/venv" | cut -f1) MB in a fresh venv"
run_dir="$work/run"
mkdir -p "$run_dir" "$work/home"
cd "$run_dir"
py() { HOME="$work/home" ZOO_OFFLINE=1 "$work/venv/bin/python" "$@"; }
# README command (a), with :smoke, and one config of each other architecture.
py -m agf_jax.train --config configs/agf/uea.py:dataset=JapaneseVowels,smoke --workdir runs/agf_jv
py -m samovar_jax.train --config configs/samovar/synthetic_var.py:smoke --workdir runs/samovar
# HTGN's number-words needs [text]: one error line naming it, exit 2, before any work.
status=0
py -m htgn_jax.train --config configs/htgn/number_words.py:smoke --workdir runs/htgn 2> "$work/err" || status=$?
cat "$work/err"
if [ "$status" != 2 ] || [ "$(wc -l < "$work/err")" != 1 ] || ! grep -q "\[text\] extra" "$work/err" || [ -e runs/htgn ]; then
  echo "wheel-check: expected one error line naming the [text] extra and exit 2, got exit $status"; exit 1
fi
# The README's Python snippets ("Use in your own model"), each as printed.
py - "$repo/README.md" <<'PY'
import re, subprocess, sys
text = open(sys.argv[1]).read()
start = text.index("## Use in your own model\n")
section = text[start:text.find("\n## ", start + 1)]
snippets = re.findall(r"```python\n(.*?)```", section, flags=re.S)
assert snippets, "no snippets"
for i, code in enumerate(snippets):
    subprocess.run([sys.executable, "-c", code], check=True)
    print(f"wheel-check: README snippet {i} ran")
PY
# A module path of 0.1.0 still imports, with a DeprecationWarning naming its new place.
py -W error::DeprecationWarning -c "import zoo_core.masking" 2> "$work/err" && { echo "wheel-check: no DeprecationWarning"; exit 1; }
grep -q "zoo_core.ops.masking" "$work/err"
py -c "import warnings; warnings.simplefilter('ignore'); import zoo_core.masking"
# With the [text] extra, the HTGN config trains.
pip_quiet "$wheel[text]"
py -m htgn_jax.train --config configs/htgn/number_words.py:smoke --workdir runs/htgn
echo "wheel-check: passed in $(( $(date +%s) - start )) s"
