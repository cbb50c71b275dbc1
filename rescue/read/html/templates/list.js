
(function(){
  'use strict';
  var D=null, F={}, byId={}, hay=[], cache={}, asked={}, observer=null, timer=null, jump=null;
  var st={f:{}, q:'', terms:[], sort:'', page:1, go:'', at:''};  // go: a case to open; at: the case opened
  function $(id){return document.getElementById(id);}
  function txt(x){return x===null||x===undefined?'':String(x);}
  function cell(r,k){return r[F[k]];}
  function known(p){
    if(p.has('q')||p.has('sort')||p.has('page')||p.has('case'))return true;
    return D.filters.some(function(f){return p.has(f[0]);});
  }
  function readHash(initial){
    var h=location.hash.slice(1);
    if(/^case-/.test(h)){st.go=decodeURIComponent(h.slice(5));return true;}
    var p=new URLSearchParams(h);
    if(h&&!known(p))return initial;  // a plain anchor: leave the view as it is
    st.f={};D.filters.forEach(function(f){if(p.get(f[0]))st.f[f[0]]=p.get(f[0]);});
    st.q=p.get('q')||'';st.sort=p.get('sort')||'';st.page=parseInt(p.get('page')||'1',10)||1;st.go=p.get('case')||'';
    return true;
  }
  function writeHash(){
    var p=new URLSearchParams();
    Object.keys(st.f).forEach(function(k){if(st.f[k])p.set(k,st.f[k]);});
    if(st.q)p.set('q',st.q);if(st.sort)p.set('sort',st.sort);if(st.page>1)p.set('page',String(st.page));
    if(st.at)p.set('case',st.at);  // the address keeps the case opened: it can be copied, shared, reloaded
    try{history.replaceState(null,'','#'+p.toString());}catch(e){}
  }
  function sync(){
    D.filters.forEach(function(f){var s=$('f-'+f[0]);if(s)s.value=st.f[f[0]]||'';});
    $('search').value=st.q;
    Array.prototype.forEach.call($('case-list').tHead.rows[0].cells,function(th){
      var k=th.dataset.sort;th.removeAttribute('aria-sort');
      if(st.sort===k)th.setAttribute('aria-sort','ascending');else if(st.sort==='-'+k)th.setAttribute('aria-sort','descending');
    });
  }
  function blank(v){return v===null||v===undefined||v==='';}
  function cmp(a,b){
    if(a===true||a===false)a=a?1:0;if(b===true||b===false)b=b?1:0;
    if(typeof a==='number'&&typeof b==='number')return a-b;
    return String(a).localeCompare(String(b),undefined,{numeric:true});
  }
  function matching(){
    var out=[],keys=Object.keys(st.f).filter(function(k){return st.f[k];});
    for(var i=0;i<D.rows.length;i++){
      var r=D.rows[i],ok=true;
      for(var j=0;j<keys.length&&ok;j++)ok=txt(cell(r,keys[j]))===st.f[keys[j]];
      for(var t=0;t<st.terms.length&&ok;t++)ok=hay[i].indexOf(st.terms[t])>=0;
      if(ok)out.push(i);
    }
    if(st.sort){
      var desc=st.sort.charAt(0)==='-',c=F[desc?st.sort.slice(1):st.sort];
      if(c!==undefined)out.sort(function(a,b){
        var x=D.rows[a][c],y=D.rows[b][c];
        if(blank(x)||blank(y))return blank(x)===blank(y)?a-b:(blank(x)?1:-1);  // blanks last either way
        return (desc?-cmp(x,y):cmp(x,y))||a-b;
      });
    }
    return out;
  }
  function fillCell(td,col,v,r){
    var kind=col[2];td.dataset.col=col[0];
    if(kind==='case'){
      if(D.panels){var a=document.createElement('a');a.href='#case='+encodeURIComponent(v);a.dataset.go=v;a.textContent=v;td.appendChild(a);}
      else td.textContent=v;
      if(F.pilot!==undefined&&cell(r,'pilot'))td.appendChild(document.createTextNode(' (pilot)'));
    }else if(kind==='ok'){td.textContent=v===true?'\u2714':v===false?'\u2718':'';}
    else if(kind==='href'){if(v){var l=document.createElement('a');l.href=v;l.textContent='panel';td.appendChild(l);}}
    else{td.textContent=txt(v);if(kind==='num')td.className='num';if(kind==='label')td.className=txt(v);if(kind==='text')td.className='text';}
  }
  function renderList(page){
    var frag=document.createDocumentFragment();
    page.forEach(function(i){
      var r=D.rows[i],tr=document.createElement('tr');
      tr.dataset.case=cell(r,'id');if(F.label!==undefined)tr.className=txt(cell(r,'label'));
      D.columns.forEach(function(col){var td=document.createElement('td');fillCell(td,col,cell(r,col[0]),r);tr.appendChild(td);});
      frag.appendChild(tr);
    });
    $('case-list').tBodies[0].replaceChildren(frag);
  }
  function fill(sec,html){
    sec.innerHTML=html;sec.dataset.loaded='1';
    if(jump===sec.dataset.case){jump=null;sec.scrollIntoView();}  // the panel asked for grew: stay on it
  }
  function goTo(id){var sec=$('case-'+id);if(!sec)return false;jump=id;load(id);sec.scrollIntoView();return true;}
  function load(id){
    var sec=$('case-'+id);
    if(cache[id]!==undefined){if(sec&&sec.dataset.loaded!=='1')fill(sec,cache[id]);return;}
    if(asked[id])return;asked[id]=1;
    var s=document.createElement('script');s.async=true;
    s.src=D.prefix+'/case/'+encodeURIComponent(id)+'.js';
    s.onerror=function(){var x=$('case-'+id);if(x){x.dataset.loaded='missing';x.lastChild.textContent='this case\'s panel file is missing from '+D.prefix+'/case/';}};
    document.head.appendChild(s);
  }
  window.rescuePanel=function(id,html){cache[id]=html;var sec=$('case-'+id);if(sec)fill(sec,html);};
  function loadAll(){Array.prototype.forEach.call(document.querySelectorAll('#panels section.case'),function(s){load(s.dataset.case);});}
  function renderPanels(page){
    var box=$('panels');if(!D.panels||!box)return;
    if(observer)observer.disconnect();
    var frag=document.createDocumentFragment();
    page.forEach(function(i){
      var r=D.rows[i],id=cell(r,'id'),sec=document.createElement('section'),h=document.createElement('h3'),sp=document.createElement('span'),body=document.createElement('p');
      sec.className='case';sec.id='case-'+id;sec.dataset.case=id;sec.dataset.loaded='0';
      h.textContent=id+' ';sp.className=txt(cell(r,'label'));sp.textContent=txt(cell(r,'label'));h.appendChild(sp);
      body.className='panel-body';body.textContent='loading\u2026';sec.appendChild(h);sec.appendChild(body);
      if(cache[id]!==undefined)fill(sec,cache[id]);
      frag.appendChild(sec);
    });
    box.replaceChildren(frag);
    $('panels-note').textContent=page.length?('The panels of the '+page.length+' case(s) on this page of the list, in its order; each loads when scrolled to.'):'No case matches.';
    var waiting=box.querySelectorAll('section.case[data-loaded="0"]');
    if('IntersectionObserver' in window){
      observer=new IntersectionObserver(function(es){es.forEach(function(e){if(e.isIntersecting){observer.unobserve(e.target);load(e.target.dataset.case);}});},{rootMargin:'400px 0px'});
      Array.prototype.forEach.call(waiting,function(s){observer.observe(s);});
    }else Array.prototype.forEach.call(waiting,function(s){load(s.dataset.case);});
  }
  function apply(){
    st.terms=st.q.toLowerCase().split(/\s+/).filter(Boolean);
    var idx=matching(),size=D.page_size;
    if(st.go&&byId[st.go]!==undefined){
      var at=idx.indexOf(byId[st.go]);
      if(at<0){st.f={};st.q='';st.terms=[];sync();idx=matching();at=idx.indexOf(byId[st.go]);}  // filtered out: show it anyway
      st.page=Math.floor(at/size)+1;st.at=st.go;
    }
    var pages=Math.max(1,Math.ceil(idx.length/size));
    st.page=Math.min(Math.max(1,st.page),pages);
    var page=idx.slice((st.page-1)*size,st.page*size);
    renderList(page);renderPanels(page);
    var out=$('shown');
    out.textContent=idx.length+' of '+D.rows.length+' case(s) match'+(pages>1?' \u00b7 page '+st.page+' of '+pages:'');
    out.dataset.shown=idx.length;out.dataset.total=D.rows.length;out.dataset.page=st.page;out.dataset.pages=pages;
    $('prev').disabled=st.page<=1;$('next').disabled=st.page>=pages;
    writeHash();sync();
    if(st.go){var g=st.go;st.go='';goTo(g);}
  }
  function controls(){
    var bar=$('filters');
    D.filters.forEach(function(f){
      var counts={},order=[];
      D.rows.forEach(function(r){var v=txt(cell(r,f[0]));if(v==='')return;if(!(v in counts)){counts[v]=0;order.push(v);}counts[v]++;});
      if(!order.length)return;
      order.sort(function(a,b){return a.localeCompare(b,undefined,{numeric:true});});
      var label=document.createElement('label'),sel=document.createElement('select');
      sel.id='f-'+f[0];label.textContent=f[1]+' ';
      var all=document.createElement('option');all.value='';all.textContent='all';sel.appendChild(all);
      order.forEach(function(v){var o=document.createElement('option');o.value=v;o.textContent=v+' ('+counts[v]+')';sel.appendChild(o);});
      sel.addEventListener('change',function(){st.f[f[0]]=sel.value;st.page=1;st.at='';apply();});
      label.appendChild(sel);bar.appendChild(label);
    });
    var head=$('case-list').tHead.rows[0];
    D.columns.forEach(function(col){
      var th=document.createElement('th');th.textContent=col[1];th.dataset.sort=col[0];th.title='sort by '+col[1];
      if(col[2]==='num')th.className='num';
      th.addEventListener('click',function(){st.sort=st.sort===col[0]?'-'+col[0]:(st.sort==='-'+col[0]?'':col[0]);st.page=1;st.at='';apply();});
      head.appendChild(th);
    });
    $('search').addEventListener('input',function(){clearTimeout(timer);timer=setTimeout(function(){st.q=$('search').value;st.page=1;st.at='';apply();},120);});
    $('prev').addEventListener('click',function(){st.page--;st.at='';apply();});
    $('next').addEventListener('click',function(){st.page++;st.at='';apply();});
    var all=$('load-all');if(all)all.addEventListener('click',loadAll);
    window.addEventListener('beforeprint',loadAll);  // a printout shows the panels, not their placeholders
    document.addEventListener('click',function(e){
      var a=e.target.closest?e.target.closest('a[data-go]'):null;if(!a)return;
      e.preventDefault();var id=a.dataset.go;
      if(goTo(id)){st.at=id;writeHash();}else{st.go=id;apply();}
    });
    window.addEventListener('hashchange',function(){if(readHash(false)){sync();apply();}});
  }
  window.rescueIndex=function(data){
    D=data;D.fields.forEach(function(k,i){F[k]=i;});
    D.rows.forEach(function(r,i){
      byId[cell(r,'id')]=i;
      hay.push(D.search.map(function(k){return txt(cell(r,k));}).join('\n').toLowerCase());
    });
    controls();readHash(true);sync();apply();
    if(performance.mark)performance.mark('rescue:list-ready');  // for a reader (or a test) timing the page
  };
})();
