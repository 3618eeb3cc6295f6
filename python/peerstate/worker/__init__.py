"""The worker's side of a job: ``Job`` and the parts it is built from."""
