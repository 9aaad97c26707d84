"""The command line (``rlhfkit COMMAND``) and what it runs besides training: the demo, chat,
the HTML report and fetch-model.
"""
