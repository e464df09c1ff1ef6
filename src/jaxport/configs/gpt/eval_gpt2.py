# Evaluate the pretrained gpt2 on OpenWebText (nanoGPT's config/eval_gpt2.py).
batch_size = 8
eval_iters = 500  # more batches for a better estimate
eval_only = True
wandb_log = False
init_from = "gpt2"
