"""The data plane's Python side: buffers, the snapshot store wrapper, and the
training state (model, optimizer, RNG) as registered buffers and objects."""
