"""Tools around a job: local simulated jobs and the goodput model."""
