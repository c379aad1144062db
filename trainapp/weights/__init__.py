"""A model's weights out of a run and into one: the safetensors file trainapp exports (written a tensor at a
time), the places weights can be read from (an export, a safetensors file, a run's snapshot, whole or
sharded), and `init.from` (a new run starting from them). The `trainapp export` command and
`trainapp.load_model`, which build the task's model, are trainapp/tools/export.py."""
