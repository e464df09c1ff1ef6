"""`jaxport dream serve`, split by concern: `protocol` (the OpenAI wire format), `api` (the FastAPI routes and
server-sent events; it tokenises each prompt once), `middleware`, `settings` (the flags), `programs` (the bounded set
of compiled programs), `metrics` (Prometheus)."""
