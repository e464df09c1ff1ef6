# A baby GPT on character-level Shakespeare (nanoGPT's config/train_shakespeare_char.py).
# `jaxport gpt prepare shakespeare_char` first. Tuned for one GPU; on a CPU see the README.

out_dir = "out-shakespeare-char"
eval_interval = 250  # evaluate often: this model overfits
eval_iters = 200
log_interval = 10

# save only when the validation loss improves
always_save_checkpoint = False

wandb_log = False
wandb_project = "shakespeare-char"
wandb_run_name = "mini-gpt"

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # characters of context

# 6 layers, 6 heads, 384 wide
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # small models tolerate a higher rate
max_iters = 5000
lr_decay_iters = 5000  # usually max_iters
min_lr = 1e-4  # usually learning_rate / 10
beta2 = 0.99  # more tokens per step would allow 0.95

warmup_iters = 100
