import sys
from pathlib import Path

# Test helpers (tests/ckpt.py) import by plain name.
sys.path.insert(0, str(Path(__file__).parent))
