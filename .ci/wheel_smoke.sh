#!/usr/bin/env bash
# The package as a user gets it: build a wheel, install it (not editable, without the test extra)
# into a fresh venv outside the checkout, and run each family's CLI from another directory.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/build-env"
"$work/build-env/bin/pip" install -q build
"$work/build-env/bin/python" -m build --wheel --outdir "$work/dist" "$repo" > "$work/build.log"
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$work"/dist/jaxport-*.whl
export PATH="$work/venv/bin:$PATH" JAX_PLATFORMS=cpu
cd "$work"
fixtures="$repo/tests/fixtures"
set -x
jaxport trm build sudoku --generate --num-train 64 --num-test 16 --givens 60 --output-dir data/sudoku
jaxport trm train data_paths=[data/sudoku] evaluators=[] arch.mlp_t=True arch.pos_encodings=none \
    arch.hidden_size=32 arch.num_heads=2 arch.H_cycles=2 arch.L_cycles=1 arch.L_layers=1 arch.halt_max_steps=2 \
    arch.puzzle_emb_len=1 arch.forward_dtype=float32 global_batch_size=16 epochs=2 eval_interval=2 max_steps=3 \
    +run_name=smoke checkpoint_path=runs/trm
test -f runs/trm/metrics.jsonl && test -d runs/trm/jaxport_checkpoints/3
jaxport gpt prepare shakespeare_char --input "$fixtures/gpt/tinyshakespeare/input.txt"
jaxport gpt train train_shakespeare_char --device=cpu --block_size=32 --batch_size=4 --n_layer=1 --n_head=2 \
    --n_embd=32 --max_iters=3 --eval_interval=3 --eval_iters=1 --log_interval=1 --progress=False \
    --always_save_checkpoint=True
jaxport gpt sample --out_dir=out-shakespeare-char --device=cpu --num_samples=1 --max_new_tokens=16 --start=ROMEO:
jaxport dream generate --model "$fixtures/dream/tiny_sharded/model" --prompt "hello" --max-new-tokens 8 --dtype float32
set +x
echo "wheel smoke: all commands ran from $work with the installed wheel"
