"""Data cards: distributions computed as data (:mod:`.distributions`), ``longreel card build`` (:mod:`.build`,
:mod:`.plots`), ``longreel card verify`` (:mod:`.verify`, :mod:`.shardread`) and the embedded demo's card
(:mod:`.demo`). See ``data_cards/README.md``."""
