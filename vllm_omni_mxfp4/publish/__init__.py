"""Publishing a checkpoint directory: staging beside the target, one write loop, an atomic rename.

:mod:`.output` is the write loop the merge and the convert share (target checks, file copies,
component writes, the progress bar); :mod:`.staging` the staging directories, their owners and the
rename into place. Imports no torch.
"""
