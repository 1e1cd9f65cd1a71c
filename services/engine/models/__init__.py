"""The node's models: the store (what can be served), the manager (what is loaded, within the memory
budget), the runtime of a loaded model, and the clients of its worker process."""
