"""The server's bounds on the work one request may ask for (its defaults; some are flags of `specdecode serve`)."""

DEFAULT_MAX_REQUEST_BYTES = 2 * 2**20  # request body; a full 8192-token prompt is ~40 kB of text, ~0.5 MB \u-escaped
MAX_STOP_STRINGS = 16
MAX_STOP_CHARACTERS = 4096  # all stop strings of a request together
RETRY_AFTER_SECONDS = 1  # what a 429 (every slot busy, the queue full) tells the client to wait
LARGE_PROMPT_CHARACTERS = 2**20  # after tokenizing a prompt this long, the freed memory goes back to the OS
