#!/usr/bin/env python3
"""Merge msModelSlim MXFP4 output into a diffusers Wan2.2 checkpoint.

The same program as ``vllm-omni-mxfp4 merge``, with the same arguments, e.g.::

    python tools/merge_mxfp4_dualscale_checkpoint.py --model-type Wan2.2-T2V-A14B \\
        --original-model /path/to/Wan2.2-T2V-A14B-Diffusers --quant-path /path/to/msmodelslim-output \\
        --output-path /path/to/Wan2.2-T2V-A14B-MXFP4-DualScale
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from vllm_omni_mxfp4.cli import merge_main
except ImportError:  # run from a source checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vllm_omni_mxfp4.cli import merge_main

if __name__ == "__main__":
    sys.exit(merge_main())
