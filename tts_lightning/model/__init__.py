"""Qwen3-TTS model side: pretrained directories, the talker sequence layout, the Lightning module."""
