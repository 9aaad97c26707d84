# Sourced by the example scripts: which Python and which rlhfkit they run, and where the model is.
#   PYTHON     the interpreter (default: the repository's .venv/bin/python when it exists, as
#              `make demo` creates it, else python3 on PATH: an activated venv's)
#   RLHFKIT    the command line (default: $PYTHON -m rlhfkit, the same installation)
#   MODEL_DIR  a real model's directory (default: where `rlhfkit fetch-model NAME` puts it,
#              fetched there first when missing; set it for a model you fetched to a directory
#              of your own with `rlhfkit fetch-model NAME DIR`)
EXAMPLES_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$EXAMPLES_ROOT/.venv/bin/python" ]; then PYTHON=$EXAMPLES_ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
RLHFKIT=${RLHFKIT:-"$PYTHON -m rlhfkit"}
if ! "$PYTHON" -c "import rlhfkit" 2>/dev/null; then
    echo "$(basename "$0"): error: $PYTHON cannot import rlhfkit: run \`make demo\` in $EXAMPLES_ROOT (it creates" \
         ".venv), activate the venv it is installed in (source .venv/bin/activate), or set PYTHON=..." >&2
    exit 2
fi

# model_dir NAME: $MODEL_DIR when set, else the directory `rlhfkit fetch-model NAME` converts it into
model_dir() {
    if [ -n "${MODEL_DIR:-}" ]; then echo "$MODEL_DIR"; else $RLHFKIT fetch-model "$1" --print-path; fi
}
