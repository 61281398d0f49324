"""``python -m vllm_omni_mxfp4.models REQUEST RESULT``: the child process that derives a model's names."""

import sys

from .derive import main

sys.exit(main(sys.argv[1:]))
