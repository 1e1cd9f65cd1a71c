"""The router: the cluster front door. Picks an engine per request and relays the call."""
