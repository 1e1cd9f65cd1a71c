"""Bootstrap shared by every llmserve service: config, server start, errors, model sources."""
