"""End-to-end tests: prompts, images and videos in, tokens out, through the exported graphs."""
