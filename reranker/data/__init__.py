"""Re-ranking data: collaborative evidence, features, reasoning-trace teachers, the train/valid/test examples, retraced and copy warm-up variants."""
