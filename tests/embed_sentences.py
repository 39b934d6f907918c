"""Sentences for the embedding tests: empty-ish, short, long, non-ASCII, of very different lengths."""

LONG = (
    "The committee reviewed the proposal in detail, weighing the expected benefits for the regional "
    "hospitals against the cost of training staff, the time needed to migrate the old records, and the "
    "risk that a rushed rollout would disrupt care during the winter season, when admissions peak. "
)

SENTENCES = [
    "",
    " ",
    ".",
    "a",
    "?!",
    "Hello, world!",
    "The cat sat on the mat.",
    "A man is playing a guitar on the street corner.",
    "Embeddings map sentences to vectors so that similar meanings lie close together.",
    "I love programming in Python; it's concise and readable.",
    "Quantum computers exploit superposition and entanglement to solve certain problems faster.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Das Wetter in Berlin ist heute überraschend schön, nicht wahr?",
    "Le château de Versailles attire des millions de visiteurs chaque année.",
    "¿Dónde está la estación de tren más cercana?",
    "東京は日本の首都であり、世界で最も人口の多い都市圏の一つです。",
    "这是一个用于测试的中文句子。",
    "Москва — столица России.",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "नमस्ते, आप कैसे हैं?",
    "Emoji test 🚀🔥👍 with symbols ©®™ and math ∑∫√π.",
    "naïve café résumé coöperate façade",
    "1234567890 3.14159 2.71828 -42 +7 1e10",
    "https://example.com/path?query=value&other=1#fragment",
    "def f(x): return x * x  # a tiny function",
    "UPPERCASE TEXT SHOULD BE LOWERCASED BY THE TOKENIZER",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\ninside",
    "word " * 40,
    LONG,
    LONG * 2,
    "Short.",
    "The patient was discharged after three days of observation with no complications.",
    "Stock markets fell sharply on Monday after the central bank raised interest rates.",
]
