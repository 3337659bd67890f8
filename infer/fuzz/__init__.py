"""A fuzz harness for the state properties (`python -m infer.fuzz`): thousands of random cases per property, in
one process, on compiled programs that every case reuses.

- `bench`: the fixed shapes a run compiles once (rows, chunk columns, prompt columns, capacity) and the calls and
  comparisons the properties share;
- `properties`: the properties, each a function that draws one batch of cases (one case per row) and returns
  each case's largest difference from its reference;
- `mutants`: one planted bug per property that the property must catch;
- `run`: draws batches until a property has its cases, counts violations, keeps the first failing draw;
- `__main__`: the command.

Nothing here imports JAX at package import, so the command can ask for simulated devices before JAX starts.
"""
