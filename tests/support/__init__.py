"""What the tests share, one module per job:

- :mod:`.processes`: the processes a test starts (stand-in replicas, routers, slow links), stopped by PID;
- :mod:`.state`: what a stand-in replica and a router say about themselves;
- :mod:`.waiting`: polling for a condition, telling whether anything listens;
- :mod:`.traffic`: chats, multi-turn conversations, steady load, streams through a kill;
- :mod:`.sse`: reading server-sent events;
- :mod:`.small_tokenizer`: a small tokenizer with a chat template;
- :mod:`.indexes`: a test body against a fresh prefix index;
- :mod:`.recipes`: what the deployment recipes set;
- :mod:`.paths`: the repository, deploy/, the fixtures.
"""
