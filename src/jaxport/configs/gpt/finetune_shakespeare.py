# Fine-tune GPT-2 XL on Shakespeare (nanoGPT's config/finetune_shakespeare.py).
# `jaxport gpt prepare shakespeare` first; the GPT-2 weights come from a local Hugging Face folder.
import time

out_dir = "out-shakespeare"
eval_interval = 5
eval_iters = 40
wandb_log = False
wandb_project = "shakespeare"
wandb_run_name = "ft-" + str(time.time())

dataset = "shakespeare"
init_from = "gpt2-xl"  # the largest GPT-2

# save only when the validation loss improves
always_save_checkpoint = False

# 1 sequence x 32 accumulation steps x 1024 tokens = 32,768 tokens per step;
# Shakespeare has 301,966 tokens, so one epoch is about 9.2 steps
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20

# fine-tune at a constant, small learning rate
learning_rate = 3e-5
decay_lr = False
