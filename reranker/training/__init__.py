"""Where training starts, the initial model (init_model), and the small components the stages
share: process groups and the gradient all-reduce (distributed), checkpoints, schedules, batches
and candidates, run logging, the epoch loop (loop), the recipe skeleton around every stage's loop
(recipe) and the RL loop both RL stages run (policy_optimization). Each stage's recipe is an
explicit loop built from these; stages never import each other."""
