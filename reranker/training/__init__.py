"""Small training components shared by the stages: process groups, checkpoints, schedules,
batches and run logging. Each stage's recipe is an explicit loop built from these."""
