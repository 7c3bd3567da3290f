"""Talking to a trained model (python -m llmtrain.chat): its models answering (engine.py), their answers' text as it
is drawn (text.py), the terminal's chat (terminal.py), and the page and OpenAI's API served over HTTP (server.py,
api.py, page.html)."""
