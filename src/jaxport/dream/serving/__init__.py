"""`jaxport dream serve`, split by concern: `protocol` (the OpenAI wire format), `api` (the FastAPI routes and
server-sent events; it tokenises each prompt once, token ids flow inward), `middleware`, `settings` (the flags),
`scheduler` (which rows run next: a pure function of the queue and the running batch), `engine` (the queue and the
worker that applies the scheduler's decisions), `batches` (a batch on the model: static, or running block by block),
`programs` (the bounded set of compiled programs), `output` (detokenising, stop strings), `metrics` (Prometheus)."""
