"""The whole-checkpoint conversion job: plan, journal, records, layers, rest, manifest.

`plan` (torch-free: the server plans a job before a worker runs it) resolves a request into
a `CheckpointJob` and names the output's files; `job.convert_checkpoint` runs it, with the
journal and records making every run resumable and `manifest` writing the finished
directory's index and manifest.
"""
