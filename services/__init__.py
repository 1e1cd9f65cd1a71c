"""llmserve's services: router, engine and worker (see each package), and what they share (common)."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]   # where ``python -m services.X`` runs, and models.yaml lives
