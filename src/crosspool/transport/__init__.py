"""Transport: the mailbox between one Instance rank and its AtnAgent (shared memory on CPU)."""
