"""Text in, text out: `dream.generate(model, tokenizer, "prompt" | messages | [...], max_new_tokens=...)`."""

import jax

from jaxport.dream.settings import count
from jaxport.dream.tokenizer import DreamTokenizer
from jaxport.errors import JaxportError


def prompt_text(tokenizer: DreamTokenizer, item, chat: bool = False, system: str | None = None) -> str:
    """The text the model sees for a prompt string (wrapped in the chat template as a user message when
    `chat`, after an optional `system` message) or a list of chat messages (always templated)."""
    if isinstance(item, list):  # chat messages
        return tokenizer.apply_chat_template(item, add_generation_prompt=True)
    if not chat:
        return item
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": item}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def generate(
    model,
    tokenizer: DreamTokenizer,
    prompts,
    *,
    max_new_tokens: int = 256,
    chat: bool = False,
    system: str | None = None,
    batch_size: int | None = None,
    **generation_args,
) -> str | list[str]:
    """Completions of a prompt string, a chat (a list of `{"role": ..., "content": ...}` messages,
    rendered with the model's chat template) or a list of either: a string for one, a list for a list.

    Each completion is cut at the first end-of-text (or DiffuCoder's `<|dlm_pad|>`), as `jaxport dream
    generate` prints it; a batch stops decoding once every row's text has ended (`diffusion_generate`'s early
    stop, which changes no text; `early_stop=False` decodes every position). Prompts run in batches of
    `batch_size` (default: all at once), left-padded to the longest prompt so that one compiled program serves
    every batch. `steps` defaults to `max_new_tokens`; the other arguments are `diffusion_generate`'s, fast
    decoding included (e.g. `alg="entropy", block_length=32, cache="dual", threshold=0.9`).
    """
    single = isinstance(prompts, str) or (
        isinstance(prompts, list) and bool(prompts) and all(isinstance(m, dict) for m in prompts)
    )
    items = [prompts] if single else list(prompts)
    if not items or not all(isinstance(item, (str, list)) for item in items):
        raise JaxportError("prompts: expected a string, a list of chat messages, or a non-empty list of those")
    texts = [prompt_text(tokenizer, item, chat, system) for item in items]
    prompt_len = max(len(tokenizer.encode(text)) for text in texts)
    batch_size = len(texts) if batch_size is None else count("batch_size", batch_size)
    # checked before it is the default of steps, so that a bad one is named as itself
    generation_args.setdefault("steps", count("max_new_tokens", max_new_tokens))
    completions = []
    for first in range(0, len(texts), batch_size):
        batch = texts[first : first + batch_size]
        # a short last batch repeats its first prompt, so it runs the same compiled program
        input_ids, attention_mask = tokenizer(batch + batch[:1] * (batch_size - len(batch)), pad_to=prompt_len)
        sequences = model.diffusion_generate(
            input_ids,
            attention_mask,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=False,
            stop_token_ids=tokenizer.stop_ids,
            **generation_args,
        )
        completions += tokenizer.decode_generation(jax.device_get(sequences), prompt_len)[: len(batch)]
    return completions[0] if single else completions
