"""The bounded set of decoding programs a server runs.

The start-up set is every allowed program (`ServeSettings.allowed`: the defaults and each `--program`) at every
prompt bucket and `max_tokens` bucket that fit `--max-context`, each compiled at every batch bucket. A request
outside it is refused with the reason, unless `--compile-on-demand N` lets the server compile its program on first
use (then at most N such programs are kept, least recently used evicted).
"""

from jaxport.dream.scheduler import BatchKey, bucket
from jaxport.dream.serving.settings import ServeSettings

# the program settings a refusal may name, in the order it looks for the first one no allowed program has
PROGRAM_FIELDS = ("alg", "steps", "block_length", "cache", "schedule", "eps")


class NotServed(Exception):
    """A request outside the programs this server runs: `param` is the request field at fault, `code` the reason."""

    def __init__(self, param: str, message: str, code: str):
        super().__init__(message)
        self.param, self.message, self.code = param, message, code


class ServedPrograms:
    """Which programs the server of `settings` runs: the start-up set and the on-demand policy."""

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.on_demand = settings.compile_on_demand

    def start_up_keys(self) -> list[BatchKey]:
        """The start-up set: every allowed program at every prompt and max_tokens bucket."""
        s = self.settings
        return [
            BatchKey(prompt_len, new_tokens, settings)
            for new_tokens in s.max_tokens_buckets
            for settings in s.allowed(new_tokens)
            for prompt_len in s.prompt_buckets
            if prompt_len + new_tokens <= s.max_context
        ]

    def prompt_bucket(self, longest: int, new_tokens: int, prompt_field: str) -> int:
        """The prompt bucket a prompt of `longest` tokens runs in with `new_tokens` new tokens. Past the largest
        bucket that fits the context, the request is refused unless `--compile-on-demand` lets the server compile
        a program for it (then its prompt length is the room the context leaves): nothing else compiles after
        start-up."""
        s = self.settings
        room = s.max_context - new_tokens
        usable = [b for b in s.prompt_buckets if b <= room]
        prompt_len = bucket(longest, usable)
        if prompt_len is not None:
            return prompt_len
        if self.on_demand:
            return room
        largest = f"the largest prompt bucket is {usable[-1]}" if usable else "no prompt bucket fits"
        raise NotServed(
            prompt_field,
            f"the prompt has {longest} tokens; with {new_tokens} new tokens and --max-context {s.max_context}, "
            f"{largest} (--prompt-buckets {','.join(map(str, s.prompt_buckets))}); start the server with a larger "
            "--prompt-buckets value, or --compile-on-demand to compile such prompts' programs on first use",
            "context_length_exceeded",
        )

    def check(self, key: BatchKey, given: set[str]):
        """Raises `NotServed` for a request whose program is not in the start-up set, unless `--compile-on-demand`
        lets the server compile it: names the first setting whose value no allowed program has (`given`: the
        settings the request set), with the allowed values."""
        allowed = self.settings.allowed(key.new_tokens)
        if key.settings in allowed or self.on_demand:
            return
        fields = PROGRAM_FIELDS
        name = next(
            (n for n in fields if getattr(key.settings, n) not in {getattr(a, n) for a in allowed}),
            next(n for n in fields if n in given) if given & set(fields) else "steps",
        )
        param = "threshold" if name == "block_length" and "block_length" not in given and "threshold" in given else name
        combos = "; ".join(
            ", ".join(f"{n}={getattr(a, n)}" for n in fields if getattr(a, n) is not None) for a in allowed
        )
        raise NotServed(
            param,
            f"{name}={getattr(key.settings, name)} is not among the programs this server compiled at start-up "
            f"for {key.new_tokens} new tokens (allowed {name}: "
            f"{', '.join(sorted({str(getattr(a, name)) for a in allowed}))}; programs: {combos}); "
            f"start it with --program or --compile-on-demand",
            "setting_not_served",
        )

    def mask_prompt(self, prompt_field: str):
        """Raises `NotServed` unless the server may compile the program of its own that a prompt holding the mask
        token needs."""
        if not self.on_demand:
            raise NotServed(
                prompt_field,
                "holds the mask token, which makes a program of its own; start the server with "
                "--compile-on-demand to serve such prompts",
                "setting_not_served",
            )
