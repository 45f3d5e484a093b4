#!/usr/bin/env bash
# One-step set-up: a virtual environment with mstrace and every extra (mstrace[all]) installed.
#   bash setup.sh                    runtime only
#   bash setup.sh --test             runtime + test tools
#   bash setup.sh --test --upgrade   the newest releases instead of the lock (scripts/upgrade_lock.sh)
# Versions come from constraints.txt, the lock the suite last passed on, so CI installs what the
# tests were written against. torch is installed first and pinned (MSTRACE_TORCH_VERSION),
# because an unpinned torch pulled in as a dependency resolves to a multi-GB CUDA build even
# on machines without a GPU. MSTRACE_VENV names the environment's folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")"
extras="all"
lock=(-c constraints.txt)
for arg in "$@"; do
  case "$arg" in
    --test) extras="all,test" ;;
    --upgrade) lock=() ;;  # into a fresh venv: what is installed already is kept
    *) echo "setup.sh: unknown option $arg (--test, --upgrade)" >&2; exit 2 ;;
  esac
done
VENV=${MSTRACE_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=${MSTRACE_TORCH_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if nvidia-smi -L >/dev/null 2>&1; then
  has_gpu=1
else
  has_gpu=0
fi

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if [ "$has_gpu" = 1 ]; then
    "${pip[@]}" install "torch==${TORCH_VERSION}"
  elif [ -n "${MSTRACE_TORCH_INDEX:-}" ]; then
    # A CPU wheel index (for example PyTorch's own) for machines without a local CPU wheel.
    "${pip[@]}" install "torch==${TORCH_VERSION}" --index-url "$MSTRACE_TORCH_INDEX"
  else
    # Machines of this project's kind keep a CPU build of this exact version on
    # local disk (pip's find-links); pinning it is what selects that file.
    "${pip[@]}" install "torch==${TORCH_VERSION}"
  fi
fi

"${pip[@]}" install "${lock[@]}" -e ".[${extras}]"

# The HTML report's test opens the page in a headless Chromium: Debian's package, where missing.
if [ "$extras" != all ] && ! command -v chromium-headless-shell >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q --no-install-recommends chromium-headless-shell >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium-headless-shell >/dev/null; }
  else
    echo "setup.sh: warning: no chromium-headless-shell; tests/test_html.py needs it (apt-get install chromium-headless-shell)" >&2
  fi
fi

# tests/test_prometheus.py scrapes `mstrace serve` with a real Prometheus: Debian's package,
# where missing (the test starts the binary itself; the package's service is not used).
if [ "$extras" != all ] && ! command -v prometheus >/dev/null 2>&1 && [ ! -x /usr/bin/prometheus ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q --no-install-recommends prometheus >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null; }
  else
    echo "setup.sh: warning: no prometheus; tests/test_prometheus.py needs it (apt-get install prometheus)" >&2
  fi
fi

if [ "$has_gpu" = 0 ]; then
  "$VENV/bin/python" - <<'PY'
import torch, sys
if torch.version.cuda is not None:
    print(f"setup.sh: warning: no GPU here but torch {torch.__version__} is a CUDA build; "
          "set MSTRACE_TORCH_INDEX to a CPU wheel index to avoid the large download", file=sys.stderr)
PY
fi
echo "setup.sh: ready ($VENV, torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
