"""The DAPO trainer: the loop, the compiled update, the objective, dynamic sampling,
experience, the warm start and evaluation."""
