"""The engine: node daemon with the request queue, sequences, scheduler, KV block manager and executor."""
