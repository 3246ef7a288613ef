import os
import sys

# (the engine's test files share engine_common.py, beside them)
sys.path.insert(0, os.path.dirname(__file__))
