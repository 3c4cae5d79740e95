"""Reasoning-trace teachers behind one interface (base.Teacher.teach -> TeacherOutput).

rule: learned LightGBM scorer + Plackett-Luce rejection sampling + template traces (traces.py);
jsonl: traces written by any external LLM; hf_llm: a local Hugging Face causal LM (imported lazily:
it pulls in torch and transformers).
"""
from reranker.data.teachers.base import Oracle, Teacher, TeacherOutput, TeachExample, rejection_sample, teacher_stats

TEACHERS = ("rule", "jsonl", "hf_llm")

__all__ = ["Oracle", "Teacher", "TeacherOutput", "TeachExample", "rejection_sample", "teacher_stats", "TEACHERS"]
