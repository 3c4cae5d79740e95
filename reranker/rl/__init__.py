"""Post-training objectives after conversion: rewards, rollouts and policy-gradient math for RL (ar_rl, rl), teacher-student divergences for on-policy distillation (opd)."""
